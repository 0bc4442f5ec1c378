"""A generated chart of 120 states: twelve compound stages of ten states each, a chain inside
each stage, a guarded skip, a shallow history per stage, and stage-to-stage transitions."""

from __future__ import annotations

from statemachine import HistoryState, State, StateChart

STAGES = 12
STEPS = 10


def _stage(index: int) -> type:
    body: dict[str, object] = {}
    states = [State(initial=(i == 0), final=False) for i in range(STEPS)]
    for i, state in enumerate(states):
        body[f"s{index}_{i}"] = state
    body[f"h{index}"] = HistoryState()
    nxt = states[0].to(states[1])
    for i in range(1, STEPS - 1):
        nxt |= states[i].to(states[i + 1])
    body[f"next{index}"] = nxt
    body[f"skip{index}"] = states[0].to(states[STEPS - 1], cond="fast")
    return State.Compound.__class__(f"stage{index}", (State.Compound,), body)


class Model:
    def __init__(self) -> None:
        self.quick = False

    def fast(self) -> bool:
        return self.quick


def _build() -> type:
    body: dict[str, object] = {}
    stages = []
    for index in range(STAGES):
        stage = _stage(index)
        body[f"stage{index}"] = stage
        stages.append(stage)
    body["start"] = State(initial=True)
    body["end"] = State(final=True)
    body["go"] = body["start"].to(stages[0])  # type: ignore[union-attr]
    advance = None
    for index in range(STAGES - 1):
        t = stages[index].to(stages[index + 1])
        advance = t if advance is None else advance | t
    body["advance"] = advance
    body["finish"] = stages[-1].to(body["end"])
    back = None
    for index in range(1, STAGES):
        t = stages[index].to(getattr(stages[index - 1], f"h{index - 1}"))
        back = t if back is None else back | t
    body["back"] = back
    return type(StateChart)("BigChart", (StateChart,), body)


BigChart = _build()


def _regions(count: int, size: int) -> type:
    """A parallel state of ``count`` regions of ``size`` states each, in a cycle."""
    body: dict[str, object] = {}
    for region in range(count):
        inner: dict[str, object] = {}
        states = [State(initial=(i == 0)) for i in range(size)]
        for i, state in enumerate(states):
            inner[f"r{region}_{i}"] = state
        step = states[0].to(states[1])
        for i in range(1, size):
            step |= states[i].to(states[(i + 1) % size])
        inner[f"step{region}"] = step
        body[f"region{region}"] = State.Compound.__class__(f"region{region}", (State.Compound,),
                                                           inner)
    return State.Parallel.__class__("grid", (State.Parallel,), body)


def _build_grid() -> type:
    grid = _regions(4, 10)
    body: dict[str, object] = {"idle": State(initial=True), "grid": grid}
    body["start"] = body["idle"].to(grid)  # type: ignore[attr-defined]
    body["reset"] = grid.to(body["idle"])  # type: ignore[attr-defined]
    return type(StateChart)("GridChart", (StateChart,), body)


#: 4 regions of 10 states: 10,000 configurations, more than ``charts paths`` explores
GridChart = _build_grid()
