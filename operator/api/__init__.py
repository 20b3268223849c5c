"""The LLMDeployment API as the operator reads it: `.spec` parsed into frozen dataclasses with the
CRD's defaults (`spec.py`, `source.py`), the Kubernetes value checks it relies on (`validation.py`,
`affinity.py`, `quantity.py`) and the CRD's unknown-field check (`strict_fields.py`). Pure code: no
API calls, no kopf."""
