"""A module of two chart classes, the second of which python-statemachine refuses: a state no
transition reaches (python-statemachine raises InvalidDefinition when the class is created, so
the module, and with it the first chart, cannot be imported)."""

from statemachine import State, StateChart


class Light(StateChart):
    off = State(initial=True)
    on = State()
    switch = off.to(on) | on.to(off)


class Broken(StateChart):
    a = State(initial=True)
    b = State()
    orphan = State()
    go = a.to(b)
    back = b.to(a)
