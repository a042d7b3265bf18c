"""The bundled cluster descriptions, installed as package data ``alpa_mini.cluster_configs``.

``pyproject.toml`` maps this folder to that package so that ``ClusterSpec.named("dgx-h100")``
finds the YAMLs from an installed (also non-editable) alpa-mini. Load them through
``alpa_mini.cluster.spec.ClusterSpec.named`` / ``ClusterSpec.load``, not by path.
"""
