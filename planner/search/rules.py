"""Why the search removed a candidate without pricing it: :class:`Rule`, one member per rule, whose
value is the message the search report prints (a template where the rule names a limit or a target), and
:class:`Rules`, the counts of one search (``SearchReport.removed_by_rule``, with one example each)."""

from __future__ import annotations

from collections import defaultdict
from enum import Enum


class Rule(Enum):
    TP_PER_NODE = "tp > GPUs per node (tensor parallel stays inside a node)"
    TP_HEADS = "tp must divide num_attention_heads"
    TP_KV_HEADS = "tp must divide num_kv_heads or be a multiple of it"
    MAX_CP = "cp > {limit} (search option max_cp)"
    CP_SEQ = "2 x cp must divide seq_length (causal load balancing)"
    PP_LAYERS = "pp > num_layers"
    MAX_PP = "pp > {limit} (search option max_pp)"
    DP_BATCH = "dp must divide global_batch_size"
    SP_SEQ = "sp needs tp to divide seq_length / cp"
    MAX_MICRO_BATCH = "micro_batch_size > {limit} (search option)"
    MAX_EP = "ep > {limit} (search option max_ep)"
    FOLD = "ep x etp must divide dp x cp x tp (experts are folded over data/context/tensor ranks)"
    FOLD_SHARD = "ep x etp must divide dp_shard x cp x tp (HSDP shard group too small)"
    INTERLEAVED_MICRO_BATCHES = "interleaved 1F1B needs micro-batches divisible by pp"
    VIRTUAL_STAGES = "pp x virtual_stages > num_layers"
    OFFLOAD_LINK = "optimizer offload needs a host<->device link in the profile"
    TARGET = "target {target} cannot run: {feature}"
    CONTRACT = "{field}: {problem}"  # a layout the contracts refuse (planner.errors.AutoparError's field and problem)

    def message(self, **values: object) -> str:
        """The report's text of this rule, its template filled with ``values``."""
        return self.value.format(**values) if values else self.value


class Rules:
    """Counts candidates removed by each rule, with one example each: ``counts`` and ``examples`` by the
    rule's message (the report's keys), :attr:`by_rule` by the rule. ``remove`` runs for every candidate a
    rule removes (over 10^5 times in a large search): one dictionary look-up once a message is known."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.examples: dict[str, str] = {}
        self._rule_of: dict[str, Rule] = {}

    def remove(self, rule: Rule, example: str, count: int = 1, **values: object) -> None:
        key = rule.message(**values)
        if key not in self._rule_of:
            self._rule_of[key], self.examples[key] = rule, example
        self.counts[key] += count

    @property
    def by_rule(self) -> dict[Rule, int]:
        """Candidates removed per rule (its messages summed)."""
        out: dict[Rule, int] = defaultdict(int)
        for key, n in self.counts.items():
            out[self._rule_of[key]] += n
        return out

    def merge(self, other: Rules, times: int = 1) -> None:
        """Add ``other``'s removals ``times`` over, in its order (its examples where this has none)."""
        for key, n in other.counts.items():
            if key not in self._rule_of:
                self._rule_of[key], self.examples[key] = other._rule_of[key], other.examples[key]
            self.counts[key] += n * times
