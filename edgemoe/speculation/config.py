"""What speculation runs with (SpeculationConfig) and what it did (SpeculationStats)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidConfigError

SPECULATE_MODES = ("off", "lookup", "draft", "mtp")
DRAFT_MAX_LIMIT = 32  # positions one verification batch checks at the most, besides the sampled token


@dataclass(frozen=True)
class SpeculationConfig:
    """mode: off | lookup (prompt lookup, no extra model) | draft (a small GGUF with the same vocabulary) |
    mtp (the model's own multi-token-prediction heads). draft_max: tokens proposed per verification at the most.
    ngram_max / ngram_min: the longest and shortest tail of the context prompt lookup searches for."""

    mode: str = "off"
    draft_max: int = 8
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE_MODES:
            raise InvalidConfigError(
                f"speculation mode {self.mode!r} is unknown: use one of {', '.join(SPECULATE_MODES)}"
            )
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise InvalidConfigError(
                f"`draft_max` {self.draft_max} is outside 1..{DRAFT_MAX_LIMIT}: a verification batch checks that "
                "many proposed tokens"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidConfigError(
                f"prompt lookup's n-gram sizes {self.ngram_min}..{self.ngram_max} are not a range: give "
                "1 <= `ngram_min` <= `ngram_max`"
            )
        if self.mode == "draft" and not self.draft_model:
            raise InvalidConfigError(
                "speculation with a draft model needs `draft_model`: the draft GGUF's path"
            )

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclass
class SpeculationStats:
    """Counters of one generation: verification steps, tokens proposed and accepted, and the smallest gap
    between the two best logits at a greedy verification (a near-tie there may flip with the batch size)."""

    mode: str
    steps: int = 0  # verification decodes (each one llama_decode of 1 + drafted positions)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the verifications produced (accepted drafts plus one sampled each)
    min_top2_gap: float | None = None

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def note_gap(self, gap: float) -> None:
        if self.min_top2_gap is None or gap < self.min_top2_gap:
            self.min_top2_gap = gap

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {
            "mode": self.mode,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "tokens_per_step": self.tokens_per_step,
            "min_top2_gap": self.min_top2_gap,
        }
