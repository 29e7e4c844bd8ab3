"""What runs on an edge device. Ships alone: never imports core/ or gui/."""

AGENT_VERSION = "0.1.0"
