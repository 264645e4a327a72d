#!/usr/bin/env python3
"""Parses OpenMetrics text on stdin with prometheus_client's own parser (the
strict one: a format error raises) and prints one sample's value.

Usage: parse_openmetrics.py FAMILY LABEL=VALUE
Prints the value of FAMILY's sample (its _total for a counter) whose label
matches, as an integer; exits 1 when the text does not parse or no sample
matches. test_stat uses it on rdmax-stat --openmetrics.
"""
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def main(argv):
    family, label = argv[0], argv[1]
    key, _, want = label.partition("=")
    text = sys.stdin.read()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        print(f"parse_openmetrics.py: the text does not parse: {err}")
        return 1
    for fam in families:
        if fam.name != family:
            continue
        for sample in fam.samples:
            if sample.labels.get(key) == want and not sample.name.endswith("_created"):
                print(int(sample.value))
                return 0
    print(f"parse_openmetrics.py: no sample of {family} with {label} "
          f"(families: {len(families)})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
