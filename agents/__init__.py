"""What runs on an edge device. Ships alone: never imports core/ or gui/."""

from agents.weight_precision import quiet_cpu_build_noise

AGENT_VERSION = "0.1.0"

quiet_cpu_build_noise()  # transformers imports torchao when it is installed: before any agent module loads a model
