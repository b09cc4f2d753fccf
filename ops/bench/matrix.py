"""The bench matrix: methods x scenarios x output lengths, measured in interleaved repeats.

    config = BenchConfig(methods=parse_methods("ar,linear,ddtree:15"), lengths=(256, 1024))
    for group in config.groups():        # scenario-major, then length
        group.cells                      # one per method, ar first: measured together
    for cell in config.cells():          # the same cells, flat
        print(cell.key, cell.method.label)

A group (a scenario at an output length) is measured as a whole: each repeat runs every method
once, back to back, in rotated order (engine.bench_stats). `repeats` is the least number of
clean repeats a group gets; more run, up to `max_repeats`, while the group's share of
`time_budget_s` lasts (0: exactly `repeats`).

A method is `ar`, `linear` (a DFlash chain of the engine's default length) or `ddtree:B` (a tree
of B nodes; `ddtree` alone means the engine's default budget). Scenarios: `decode` (one fixed
prompt), `long` (a prompt filling max-model-len minus the output length), `agentic` (a multi-turn
tool-use pipeline at ~4k context, measured end to end). Pure data: no I/O here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ops.errors import DdopsError

SCENARIOS = ("decode", "long", "agentic")
DEFAULT_METHODS = "ar,linear,ddtree:15"
DEFAULT_LENGTHS = (256, 1024, 2048)
DEFAULT_REPEATS = 3
DEFAULT_MAX_REPEATS = 20
DEFAULT_TIME_BUDGET_S = 600.0
_METHOD = re.compile(r"^(ar|linear|ddtree)(?::([0-9]+))?$")


@dataclass(frozen=True)
class Method:
    """One decoding method as a request asks for it (`"speculative": {"method", "budget"}`)."""

    name: str
    budget: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name}:{self.budget}" if self.budget is not None else self.name

    def speculative(self) -> dict:
        """The request body's `speculative` field."""
        return {"method": self.name, **({"budget": self.budget} if self.budget else {})}


def parse_method(text: str) -> Method:
    """`ar`, `linear`, `ddtree` or `ddtree:B` (B >= 1), or DdopsError."""
    match = _METHOD.match(text.strip())
    if not match:
        raise DdopsError(f"method {text!r}", "expected ar, linear, ddtree or ddtree:BUDGET")
    name, budget = match.group(1), match.group(2)
    if budget is not None and (name != "ddtree" or not 1 <= int(budget) <= 1024):
        raise DdopsError(f"method {text!r}", "only ddtree takes a budget, 1..1024")
    return Method(name, int(budget) if budget is not None else None)


def parse_methods(text: str) -> tuple[Method, ...]:
    """A comma list of methods, duplicates dropped, order kept."""
    methods = [parse_method(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise DdopsError("methods", "name at least one method")
    return tuple(dict.fromkeys(methods))


def parse_lengths(text: str) -> tuple[int, ...]:
    """A comma list of output lengths in tokens (each >= 2: decode speed needs two tokens)."""
    try:
        lengths = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise DdopsError(f"lengths {text!r}", "expected whole numbers like 256,1024") from None
    if not lengths or min(lengths) < 2:
        raise DdopsError(f"lengths {text!r}", "each length must be at least 2 tokens")
    return lengths


def parse_scenarios(text: str) -> tuple[str, ...]:
    scenarios = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise DdopsError(f"scenario {text!r}", f"choose from {', '.join(SCENARIOS)}")
    return scenarios


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: a scenario at an output length, decoded by a method."""

    scenario: str
    length: int
    method: Method

    @property
    def key(self) -> str:
        """A stable name, safe as a file name: `decode-256-ddtree-15`."""
        return f"{self.scenario}-{self.length}-{self.method.label.replace(':', '-')}"

    @property
    def column(self) -> str:
        """The report column this cell belongs to: `decode 256`."""
        return f"{self.scenario} {self.length}"


@dataclass(frozen=True)
class Group:
    """The cells of one scenario and output length: measured together, interleaved."""

    scenario: str
    length: int
    cells: tuple[Cell, ...]

    @property
    def column(self) -> str:
        return f"{self.scenario} {self.length}"


@dataclass(frozen=True)
class AgenticShape:
    """The agentic pipeline: `turns` requests whose transcript grows to ~`context` tokens."""

    context: int = 4096
    turns: int = 4


@dataclass(frozen=True)
class BenchConfig:
    """Everything that decides what a run measures (stored in its manifest; resumes match it)."""

    methods: tuple[Method, ...] = field(default_factory=lambda: parse_methods(DEFAULT_METHODS))
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    scenarios: tuple[str, ...] = ("decode",)
    repeats: int = DEFAULT_REPEATS  # at least this many clean repeats per group
    warmup: int = 1
    agentic: AgenticShape = AgenticShape()
    temperature: float = 0.0
    seed: int = 0
    max_repeats: int = DEFAULT_MAX_REPEATS
    time_budget_s: float = DEFAULT_TIME_BUDGET_S  # the run's, shared evenly by its groups

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise DdopsError("bench", "repeats must be >= 1 and warmup >= 0")
        if self.max_repeats < self.repeats or self.time_budget_s < 0:
            raise DdopsError("bench", "max repeats must be >= repeats and the time budget >= 0")
        if self.agentic.turns < 1 or self.agentic.context < 16:
            raise DdopsError("bench", "the agentic scenario needs >= 1 turn and >= 16 tokens")

    def cells(self) -> list[Cell]:
        """Scenario-major, then length, then method in the order given (ar first when named)."""
        methods = sorted(self.methods, key=lambda m: m.name != "ar")
        return [
            Cell(scenario, length, method)
            for scenario in self.scenarios
            for length in self.lengths
            for method in methods
        ]

    def groups(self) -> list[Group]:
        """The cells by scenario and length, in cells() order."""
        groups: dict[tuple[str, int], list[Cell]] = {}
        for cell in self.cells():
            groups.setdefault((cell.scenario, cell.length), []).append(cell)
        return [Group(s, n, tuple(cells)) for (s, n), cells in groups.items()]

    def to_json(self) -> dict:
        data = asdict(self)
        data["methods"] = [m.label for m in self.methods]
        return data

    @classmethod
    def from_json(cls, data: dict) -> BenchConfig:
        return cls(
            methods=tuple(parse_method(m) for m in data["methods"]),
            lengths=tuple(data["lengths"]),
            scenarios=tuple(data["scenarios"]),
            repeats=data["repeats"],
            warmup=data["warmup"],
            agentic=AgenticShape(**data["agentic"]),
            temperature=data["temperature"],
            seed=data["seed"],
            max_repeats=data.get("max_repeats", data["repeats"]),  # runs before issue 31
            time_budget_s=data.get("time_budget_s", 0.0),
        )
