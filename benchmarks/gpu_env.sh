# Source on a GPU machine, from the root of a source checkout that is not installed:
#   source benchmarks/gpu_env.sh
# Makes the checkout importable as `fuselane` (a link under /tmp named after the package, on
# PYTHONPATH), so that `python3 -m fuselane.<module>` and `python3 -m fuselane.serving.cli` run the
# checkout's code, and prints the versions the results will record.
mkdir -p /tmp/fuselane-src && ln -sfn "$PWD" /tmp/fuselane-src/fuselane
export PYTHONPATH=/tmp/fuselane-src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
