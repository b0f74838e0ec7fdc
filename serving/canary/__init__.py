"""The Ray Serve canary: stock-kernel and custom-kernel vLLM replicas behind one OpenAI ingress.

Modules, from the bottom up (only `engine`, `router`, `monitor` and `app` import Ray Serve LLM;
`config`, `split`, `shadow` and `rollback` are plain Python, testable without Ray):

- `config`: the YAML schema (`CanaryConfig`), `load_config`, one clear error per bad field;
- `split`: which arm a request goes to (weight, sticky keys, pinning);
- `shadow`: comparing the two arms' greedy answers (token agreement, logprob divergence);
- `rollback`: sliding windows of per-arm outcomes and the threshold decisions;
- `metrics`: the `fuselane_canary_*` metrics through `ray.util.metrics`;
- `kernel_metrics`: reads the fuselane kernel metrics a replica's engine writes and mirrors
  them into Ray's Prometheus export;
- `engine`: the arm deployment (Ray Serve LLM's `LLMServer` around vLLM's `AsyncLLM`);
- `monitor`: one replica that aggregates all ingress replicas' outcomes and decides rollbacks;
- `router`: the OpenAI ingress (Ray Serve LLM's `OpenAiIngress`) that routes by weight;
- `app`: `build_app(config)` and `app_builder(args)` for `serve run` / `serve deploy`;
- `control`: deploy, reweight and read the status of a running canary (the CLI's back end);
- `demo`: `fuselane demo`; `cli`: `add_parser(subparsers)`.

Importing this package changes no global state.
"""
