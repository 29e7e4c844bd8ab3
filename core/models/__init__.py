"""The model as a sequence of units, and its checkpoints.

Public: ``units`` (ModelSpec, ModelUnit: the unit table from an HF config.json, without
weights), ``checkpoints`` (make and read local HF checkpoints), ``stage_checkpoint`` (a
checkpoint cut down to one stage's units, for upload).
"""
