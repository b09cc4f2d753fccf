"""The bench matrix: methods x scenarios x output lengths x concurrency, in interleaved repeats.

    config = BenchConfig(methods=parse_methods("ar,linear,ddtree:15"), lengths=(256, 1024),
                         concurrency=(1, 4))
    for group in config.groups():        # scenario-major, then length, then concurrency
        group.cells                      # one per method, ar first: measured together
    for cell in config.cells():          # the same cells, flat
        print(cell.key, cell.method.label)

A group (a scenario at an output length and a concurrency) is measured as a whole: each repeat
runs every method once, back to back, in rotated order (engine.bench_stats). `repeats` is the
least number of clean repeats a group gets; more run, up to `max_repeats`, while the group's
share of `time_budget_s` lasts (0: exactly `repeats`).

Concurrency N: a method's turn in a repeat is a window of N clients at once, each sending
`requests_per_client` requests, the next when its last finishes (closed loop); with
`request_rate` R the window's N x requests_per_client requests arrive as a Poisson process of R
a second instead (open loop, at most N in flight), the same arrivals for every method of a
repeat. `slo` (ttft_s, tpot_s) decides which requests count for goodput.

Servers side by side: with `servers` > 1 every method runs on each server (`Cell.server`, 0 =
the first `--url`), all of them interleaved in the same repeats.

A method is `ar`, `linear` (a DFlash chain of the engine's default length), `ddtree:B` (a tree
of B nodes; `ddtree` alone means the engine's default budget), `auto` / `auto:B` (each round's
nodes chosen for the batch, at most B: engine/budgets.py) or `default` (the request names
no method: whatever the server is set to decode with, as any OpenAI client sends). Scenarios: `decode` (one fixed
prompt), `long` (a prompt filling max-model-len minus the output length), `agentic` (a multi-turn
tool-use pipeline at ~4k context, measured end to end). Pure data: no I/O here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from engine.methods import METHODS, TREE_METHODS
from ops.errors import DdopsError

SCENARIOS = ("decode", "long", "agentic")
DEFAULT_METHODS = "ar,linear,ddtree:15"
DEFAULT_LENGTHS = (256, 1024, 2048)
DEFAULT_REPEATS = 3
DEFAULT_MAX_REPEATS = 20
DEFAULT_TIME_BUDGET_S = 600.0
MAX_CONCURRENCY = 1024
SERVER_DEFAULT = "default"  # the method a request that names none gets
BENCH_METHODS = (*METHODS, SERVER_DEFAULT)  # in table order
_METHOD = re.compile(rf"^({'|'.join(BENCH_METHODS)})(?::([0-9]+))?$")
_SLO_PART = re.compile(r"^(ttft|tpot)=([0-9]*\.?[0-9]+)(ms|s)$")


@dataclass(frozen=True)
class Method:
    """One decoding method as a request asks for it (`"speculative": {"method", "budget"}`)."""

    name: str
    budget: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name}:{self.budget}" if self.budget is not None else self.name

    def speculative(self) -> dict | None:
        """The request body's `speculative` field (None: the server's default, no field)."""
        if self.name == SERVER_DEFAULT:
            return None
        return {"method": self.name, **({"budget": self.budget} if self.budget else {})}


def parse_method(text: str) -> Method:
    """`ar`, `linear`, `ddtree`, `ddtree:B` (B >= 1), `auto`, `auto:B` or `default`, or
    DdopsError."""
    match = _METHOD.match(text.strip())
    if not match:
        raise DdopsError(
            f"method {text!r}",
            "expected ar, linear, ddtree, ddtree:BUDGET, auto, auto:BUDGET or default",
        )
    name, budget = match.group(1), match.group(2)
    if budget is not None and (name not in TREE_METHODS or not 1 <= int(budget) <= 1024):
        raise DdopsError(f"method {text!r}", "only ddtree and auto take a budget, 1..1024")
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


def parse_concurrency(text: str) -> tuple[int, ...]:
    """A comma list of client counts, e.g. `1,4,8` (each 1..MAX_CONCURRENCY), ascending."""
    try:
        levels = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise DdopsError(f"concurrency {text!r}", "expected whole numbers like 1,4,8") from None
    if not levels or min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
        raise DdopsError(f"concurrency {text!r}", f"each level must be 1..{MAX_CONCURRENCY}")
    return tuple(sorted(levels))


@dataclass(frozen=True)
class Slo:
    """A service-level objective: a request is good when both its figures are within."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, ttft_s: float, tpot_s: float | None) -> bool:
        within_ttft = self.ttft_s is None or ttft_s <= self.ttft_s
        within_tpot = self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s
        return within_ttft and within_tpot

    @property
    def text(self) -> str:
        parts = [
            f"{name}<={1000 * value:g}ms"
            for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
            if value is not None
        ]
        return ", ".join(parts)


def parse_slo(text: str) -> Slo:
    """`ttft=2s,tpot=100ms` (either or both; units s or ms) -> Slo, or DdopsError."""
    values: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = _SLO_PART.match(part)
        if not match or match.group(1) in values:
            raise DdopsError(f"slo {text!r}", "expected ttft=2s,tpot=100ms (units s or ms)")
        scale = 0.001 if match.group(3) == "ms" else 1.0
        values[match.group(1)] = float(match.group(2)) * scale
    if not values or not all(v > 0 for v in values.values()):
        raise DdopsError(f"slo {text!r}", "name ttft and/or tpot, each above 0")
    return Slo(values.get("ttft"), values.get("tpot"))


def parse_scenarios(text: str) -> tuple[str, ...]:
    scenarios = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise DdopsError(f"scenario {text!r}", f"choose from {', '.join(SCENARIOS)}")
    return scenarios


def column_name(scenario: str, length: int, concurrency: int = 1) -> str:
    """A report column: `decode 256`, at a concurrency above 1 `decode 256 c4`."""
    return f"{scenario} {length}" + (f" c{concurrency}" if concurrency != 1 else "")


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: a scenario at an output length and a concurrency, decoded by a
    method."""

    scenario: str
    length: int
    method: Method
    concurrency: int = 1
    server: int = 0  # which of the run's servers (0: the first or only one)

    @property
    def key(self) -> str:
        """A stable name, safe as a file name: `decode-256-ddtree-15`, `decode-256-c4-ar`,
        on a second server `decode-256-ar-s2`."""
        level = f"c{self.concurrency}-" if self.concurrency != 1 else ""
        server = f"-s{self.server + 1}" if self.server else ""
        return f"{self.scenario}-{self.length}-{level}{self.method.label.replace(':', '-')}{server}"

    @property
    def column(self) -> str:
        return column_name(self.scenario, self.length, self.concurrency)


@dataclass(frozen=True)
class Group:
    """The cells of one scenario, output length and concurrency: measured together, interleaved."""

    scenario: str
    length: int
    cells: tuple[Cell, ...]
    concurrency: int = 1

    @property
    def column(self) -> str:
        return column_name(self.scenario, self.length, self.concurrency)


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
    concurrency: tuple[int, ...] = (1,)  # clients at once, one group per level
    requests_per_client: int = 1  # requests each client sends in a method's window
    request_rate: float | None = None  # requests a second, Poisson arrivals (None: closed loop)
    slo: Slo | None = None  # what a request must meet to count for goodput
    servers: int = 1  # servers side by side (each method runs on each)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise DdopsError("bench", "repeats must be >= 1 and warmup >= 0")
        if self.requests_per_client < 1 or not all(c >= 1 for c in self.concurrency):
            raise DdopsError("bench", "concurrency and requests per client must be >= 1")
        if self.servers < 1:
            raise DdopsError("bench", "name at least one server")
        if self.request_rate is not None and not self.request_rate > 0:
            raise DdopsError("bench", "the request rate must be above 0")
        if self.max_repeats < self.repeats or self.time_budget_s < 0:
            raise DdopsError("bench", "max repeats must be >= repeats and the time budget >= 0")
        if self.agentic.turns < 1 or self.agentic.context < 16:
            raise DdopsError("bench", "the agentic scenario needs >= 1 turn and >= 16 tokens")

    def cells(self) -> list[Cell]:
        """Scenario-major, then length, then concurrency, then method in the order given (ar
        first when named), then server."""
        methods = sorted(self.methods, key=lambda m: m.name != "ar")
        return [
            Cell(scenario, length, method, level, server)
            for scenario in self.scenarios
            for length in self.lengths
            for level in self.concurrency
            for method in methods
            for server in range(self.servers)
        ]

    def groups(self) -> list[Group]:
        """The cells by scenario, length and concurrency, in cells() order."""
        groups: dict[tuple[str, int, int], list[Cell]] = {}
        for cell in self.cells():
            groups.setdefault((cell.scenario, cell.length, cell.concurrency), []).append(cell)
        return [Group(s, n, tuple(cells), c) for (s, n, c), cells in groups.items()]

    def to_json(self) -> dict:
        data = asdict(self)
        data["methods"] = [m.label for m in self.methods]
        serial = self.concurrency == (1,) and self.requests_per_client == 1
        if serial and self.request_rate is None and self.slo is None and self.servers == 1:
            for name in ("concurrency", "requests_per_client", "request_rate", "slo", "servers"):
                data.pop(name)  # one request at a time: the config (and its resume) as before
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
            concurrency=tuple(data.get("concurrency", (1,))),  # runs before issue 37: one
            requests_per_client=data.get("requests_per_client", 1),
            request_rate=data.get("request_rate"),
            slo=Slo(**data["slo"]) if data.get("slo") else None,
            servers=data.get("servers", 1),
        )
