"""The files derived from declarations, written by `eagle3 pipeline write` and checked by
`eagle3 pipeline check`: dvc.yaml from the stages (eagle3/core/pipeline.py) and the code's
imports, params.yaml from the params schema (eagle3/core/params.py)."""
