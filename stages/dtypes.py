"""Stage dtypes: resolve every `auto` dtype on this machine (eagle3/dtypes/decisions.py) and
record the decisions (eagle3/dtypes/resolved.py). DVC runs it on every repro (always_changed);
the files it writes change only when a decision does, and only the stages that list the changed
file re-run. It checks first what the target's config alone can refuse (the aux layer ids), so a
run with such a param fails before it measures anything and leaves the recorded decisions as
they were."""

from __future__ import annotations

from eagle3.core.device import machine
from eagle3.core.params import check_against_target
from eagle3.dtypes.decisions import resolve, table
from eagle3.dtypes.resolved import FOLDER, record
from eagle3.target.load import load_target_config
from eagle3.train.prepare import dtype_shapes
from stages.common import console, reported_failures, validated_params


def main() -> None:
    params = validated_params()
    with reported_failures("dtypes"):
        config = load_target_config(params.target).get_text_config()  # Kimi-K2.5 nests it
        check_against_target(params, config.num_hidden_layers, config.vocab_size)
        resolved = resolve(params, dtype_shapes(params))
        record(resolved)
    console.print(table(resolved))
    console.print(f"on {machine()}; recorded in {FOLDER}/")


if __name__ == "__main__":
    main()
