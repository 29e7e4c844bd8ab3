"""The domain and the operator-side machinery. Pure Python: never imports Qt or gui/.

Organised in domain wings, each a package whose ``__init__`` names its public surface;
a wing imports only the shared modules and the wings before it (an import-linter
contract in pyproject.toml; docs/architecture.md draws the house):

    errors, formats, paths, reporting   shared by every wing
    models     the model as units (unit table from config.json), checkpoints, stage slices
    devices    cluster, discovery, deploy, agent link, testbed, local cluster, profiling, profile
    planning   problem, plan, edits, cost model, scenarios, solvers
    runs       coordinator, run state, generation, metrics, simulator, prediction
    sessions   SQLite store, recording, replay, export
    serving    ``edgeshard serve``: the OpenAI-compatible HTTP endpoint over the run path
    cli        the ``edgeshard`` command, one module per command group
"""
