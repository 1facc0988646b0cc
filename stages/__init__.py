"""DVC stage entry points: `python -m stages.<name>`. Each reads and validates params.yaml,
calls the eagle3 library, writes its outs, metrics and plots, and logs to MLflow."""
