"""Layer sharding's plan view: the plan editor (stage strip, stage table, solver box, strategy
comparison) and the planning jobs it runs on a worker."""
