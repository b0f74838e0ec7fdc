"""The test helpers' PromQL and Grafana-templating parsing, on the dashboards' idioms."""

from .panels import rate_interval
from .promql import metric_names, substitute


def test_metric_names_skip_functions_labels_and_strings():
    expr = (
        'histogram_quantile(0.99, sum by (le, arm) ((rate(ray_vllm_ttft_bucket{model_name=~"m"}'
        "[8s]) * on (WorkerId) group_left (arm) label_replace(group by (WorkerId, deployment) "
        '(ray_serve_info{application=~"a(-b)?"}), "arm", "$1", "deployment", "(.*)"))))'
        " / ignoring (arm) group_left () sum(up offset 5m) > bool 0"
    )
    assert metric_names(expr) == {"ray_vllm_ttft_bucket", "ray_serve_info", "up"}
    assert metric_names("sum(rate(vllm:time_to_first_token_seconds_count[1m]))") == {
        "vllm:time_to_first_token_seconds_count"
    }


def test_substitute_follows_grafana_syntax():
    values = {"prefix": "ray_fuselane", "arm": ".*", "__rate_interval": "8s"}
    text = 'rate(${prefix}_x{arm=~"$arm", q="[[arm]]"}[$__rate_interval]) "$1" $unknown'
    assert substitute(text, values) == ('rate(ray_fuselane_x{arm=~".*", q=".*"}[8s]) "$1" $unknown')


def test_rate_interval_is_grafanas():
    assert rate_interval(1.0, step_s=2.0) == "4s"  # 4 x scrape
    assert rate_interval(5.0, step_s=30.0) == "35s"  # step + scrape
