"""Write operator/prometheusrule.yaml: the alert groups of alerts.yml wrapped in a PrometheusRule.

alerts.yml is the one source of the rules (promtool checks and unit-tests it); the Prometheus
Operator needs them as a PrometheusRule object. ``--check`` exits 1 when the committed file differs
from what this would write (CI runs it through the tests).

    python3 deploy/prometheus/make_prometheusrule.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "alerts.yml"
TARGET = HERE / "operator" / "prometheusrule.yaml"
HEADER = ("# Generated from ../alerts.yml by ../make_prometheusrule.py; edit alerts.yml and rerun it.\n"
          "# The same alert rules, as a PrometheusRule for the Prometheus Operator.\n")


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    groups = yaml.safe_load(SOURCE.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvroute"},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is stale; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
