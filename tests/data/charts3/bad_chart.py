"""A chart class whose definition python-statemachine refuses: a state no transition
reaches (python-statemachine raises InvalidDefinition when the class is created)."""

from statemachine import State, StateChart


class Broken(StateChart):
    a = State(initial=True)
    b = State()
    orphan = State()
    go = a.to(b)
    back = b.to(a)
