"""The studio's links to agents and devices, no widgets: attaching a coordinator's agents to the
screens (``attach``), watching for lost ones (``lifecycle``), the Run screen's backend on
them (``cluster_backend``) and the Deploy dialog's SSH side (``deploy_adapter``)."""
