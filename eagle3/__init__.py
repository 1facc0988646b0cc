"""eagle3: trains EAGLE-3 drafters for a target LLM and measures what they buy.

The folder list is the map, foundations first: each entry imports only entries above it (and
itself), never one below; tests/test_layers.py checks this against LAYERS. stages/ calls into it.
    core/               params schema, the pipeline's stages (pipeline.py), deterministic stage
                        outputs (all replaced together when a stage succeeds, none when it fails:
                        stage_commit.py), input errors, packaged files, the machine (device.py),
                        the layer-id convention every engine shares
                        (layer_ids.py), MLflow glue; imports nothing else of eagle3
    dtypes/             which dtype each job computes in: measured on its work, decided by one rule,
                        kept per machine, recorded per run for DVC
    target/             the target model: load it, render text as it reads it, capture, patch-check
    data/               conversations, the feature store, the extraction loop, the rows' bytes
                        between processes (wire.py: torch-only, imported inside SGLang servers)
    vocab.py            the draft vocabulary (d2t/t2d) and its coverage
    drafter/            the EAGLE-3 draft model and the DFlash block drafter, their exports
                        and costs, warm start
    train/              the TTT unroll, the loop, simulated acceptance
    decoding/           speculative decoding and its evaluation
    sglang/             the SGLang adapter: server args, client, rows, patch-check, extraction and
                        evaluation on SGLang servers, built on target/, data/, drafter/, decoding/
    backends.py         the target backends (hf, sglang), one Protocol per role: the stages call it
    derived/            dvc.yaml and params.yaml written from their declarations (core/pipeline.py,
                        core/params.py) and the stages' imports; no stage imports it
    sweep/              experiments as rows, what a run costs (the plan), the sweep's decision and
                        its report files; no stage imports it
    cli/                the `eagle3` command: parses arguments and prints; no stage imports it
"""

from __future__ import annotations

# The map above as data, lowest first: a module of eagle3/ may import from its own entry or one
# listed before it. Read by tests/test_layers.py; nothing at run time reads it.
LAYERS = (
    "core",
    "dtypes",
    "target",
    "data",
    "vocab",
    "drafter",
    "train",
    "decoding",
    "sglang",
    "backends",
    "derived",
    "sweep",
    "cli",
)
