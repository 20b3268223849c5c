"""The children of an LLMDeployment: built as manifests from the parsed spec (`deployment.py`,
`companions.py`, `manifests.py`) and written with create-or-update under the operator's ownership
rules (`ownership.py`, `apply.py`)."""
