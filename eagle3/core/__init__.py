"""Shared foundations every stage stands on: the params schema, deterministic stage outputs,
input-file errors, packaged files, the machine and its dtypes, packed weights, the layer-id
convention every engine shares, MLflow glue.
Nothing here imports from the rest of eagle3."""
