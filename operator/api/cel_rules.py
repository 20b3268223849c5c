"""The CEL rules of the LLMDeployment CRD that no field declaration implies: rules between fields
and formats a kind cannot state. crd.py lays them over the generated schema at the path given
(a path that no longer exists is an error, so a renamed field cannot drop its rule).

A real API server estimates each rule's cost and compiles it against the schema: an optional
field is absent unless written, so every rule reads one only behind `has()` (see
tests/operator/crd_semantics.py). Each rule here has its twin in the parser (spec.py's `_check_*`
and field checks), which reports the same problem as InvalidSpec."""

from __future__ import annotations

from kvasir.operator.api.kinds import Rule


def _rule(rule: str, message: str) -> Rule:
    return {"rule": rule, "message": message}


_GROUP_GPUS = (
    "(has(self.resources) && has(self.resources.gpus) ? self.resources.gpus : 1) * "
    "(has(self.parallelism.nodes) ? self.parallelism.nodes : 1)"
)
_PARALLELISM_SPLIT = [
    _rule(
        "!has(self.parallelism) || (has(self.parallelism.tensor) ? self.parallelism.tensor : 1) * "
        f"(has(self.parallelism.pipeline) ? self.parallelism.pipeline : 1) == {_GROUP_GPUS}",
        "parallelism.tensor x parallelism.pipeline must equal resources.gpus x parallelism.nodes "
        "(the GPUs of one replica)",
    )
]

ZERO_NEEDS_ROUTER = (
    "autoscaling.minReplicas 0 needs routing.mode kvasir: Kvasir's router holds the requests that "
    "arrive while no replica runs and wakes the deployment; nothing else would"
)

RULES: dict[str, list[Rule]] = {
    "spec.model": [
        _rule(
            "!has(self.revision) || self.source.startsWith('hf://')",
            "model.revision applies only to hf:// sources",
        ),
        _rule(
            "!(has(self.cacheSize) || has(self.cacheVolumeClaim)) || self.source.startsWith('hf://')",
            "model.cacheSize and model.cacheVolumeClaim apply only to hf:// sources (a download cache)",
        ),
        _rule(
            "!(has(self.cacheSize) && has(self.cacheVolumeClaim))",
            "set model.cacheSize (a per-pod emptyDir) or model.cacheVolumeClaim (a shared claim), not both",
        ),
    ],
    "spec.model.source": [
        _rule(
            "self.matches('^hf://[^/]+/[^/]+(/.+[.]gguf)?$') || "
            "self.matches('^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$') || self.matches('^/.+')",
            "model.source must be hf://ORG/NAME, hf://ORG/NAME/FILE.gguf, pvc://CLAIM[/PATH] or an absolute path",
        )
    ],
    "spec.runtime.speculativeDecoding": [
        _rule(
            "self.method == 'draft_model' ? has(self.model) : !has(self.model)",
            "speculativeDecoding.model is required for method draft_model and applies to no other",
        ),
        _rule(
            "self.method == 'layer_skip' ? has(self.numLayers) : !has(self.numLayers)",
            "speculativeDecoding.numLayers is required for method layer_skip and applies to no other",
        ),
        _rule(
            "self.method == 'ngram' || !(has(self.promptLookupMax) || has(self.promptLookupMin))",
            "speculativeDecoding.promptLookupMax and promptLookupMin apply only to method ngram",
        ),
        _rule(
            "!has(self.promptLookupMax) || !has(self.promptLookupMin) || self.promptLookupMin <= self.promptLookupMax",
            "speculativeDecoding.promptLookupMin must not exceed promptLookupMax",
        ),
    ],
    # An exclusive upper bound: OpenAPI's exclusiveMaximum would say it, but a CEL message says it better.
    "spec.runtime.speculativeDecoding.minAcceptanceRate": [
        _rule(
            "self >= 0.0 && self < 1.0",
            "speculativeDecoding.minAcceptanceRate must be at least 0 and less than 1",
        )
    ],
    "spec.parallelism": [
        # A pod that cannot start is worse than a refused spec: the runtime refuses
        # --pipeline-parallel-size above 1, so a group asking for stages would crash-loop.
        _rule(
            "!has(self.pipeline) || self.pipeline == 1",
            "parallelism.pipeline above 1 is not supported: the runtime has no pipeline parallelism; "
            "split a model across nodes with parallelism.tensor (resources.gpus x parallelism.nodes)",
        )
    ],
    "spec.routing": [
        _rule(
            "!has(self.endpointPicker) || (has(self.mode) && self.mode == 'gateway')",
            "routing.endpointPicker applies only to mode gateway",
        )
    ],
    "spec.routing.endpointPicker": [
        _rule(
            "!has(self.service) || !has(self.image)",
            "routing.endpointPicker.image applies only when the operator deploys the picker (no service)",
        )
    ],
    # The GPUs of a group (resources.gpus on each of parallelism.nodes pods) split into tensor x
    # pipeline ranks, every one used. Each optional field behind has(): resources and its gpus are
    # defaulted, but a rule must not rely on it.
    "spec": [
        *_PARALLELISM_SPLIT,
        _rule(
            "!has(self.lora) || !has(self.model.servedName) || "
            "self.lora.all(a, a.name != self.model.servedName)",
            "a lora adapter may not take the base model's servedName",
        ),
        _rule(
            "!has(self.loraAliases) || self.loraAliases.all(al, al.targets.all(t, "
            "has(self.lora) && self.lora.exists(a, a.name == t.adapter)))",
            "every loraAliases target must name an adapter of spec.lora",
        ),
        _rule(
            "!has(self.loraAliases) || !has(self.lora) || "
            "self.loraAliases.all(al, !self.lora.exists(a, a.name == al.name))",
            "a loraAliases name may not be an adapter's name",
        ),
        # Scaling to zero needs an activator: something that holds the first request while a pod
        # starts and asks for one. Kvasir's router is it; a Service has no endpoint to send to, and
        # a gateway's endpoint picker answers at once that none exists.
        _rule(
            "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || "
            "self.autoscaling.minReplicas > 0 || "
            "(has(self.routing) && has(self.routing.mode) && self.routing.mode == 'kvasir')",
            ZERO_NEEDS_ROUTER,
        ),
    ],
    "spec.lora": [
        _rule("self.all(a, self.exists_one(b, b.name == a.name))", "lora adapter names must be unique"),
        _rule(
            "self.all(a, !has(a.revision) || a.source.startsWith('hf://'))",
            "a lora revision applies only to hf:// sources",
        ),
    ],
    "spec.loraAliases": [
        _rule("self.all(a, self.exists_one(b, b.name == a.name))", "loraAliases names must be unique"),
        _rule(
            "self.all(al, al.targets.map(t, t.weight).sum() == 100)",
            "the weights of each loraAliases entry must sum to 100",
        ),
        _rule(
            "self.all(al, al.targets.all(t, al.targets.exists_one(u, u.adapter == t.adapter)))",
            "a loraAliases entry may name each adapter once",
        ),
    ],
    "spec.rollout": [
        _rule(
            "!has(self.maxSurge) || !has(self.maxUnavailable) || "
            "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
            "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never progress",
        )
    ],
}
