"""Tests a newcomer drives the fixtures with (``calexec charts cover``/``mutate`` run them:
tests/test_charts3_tools.py)."""

from big_chart import BigChart, Model
from media_player import MediaPlayer, Player
from order_flow import Order, OrderFlow


def test_media() -> None:
    machine = MediaPlayer(model=Player())
    for event in ["play", "plug", "pause", "resume", "tick", "restart", "seek", "sought",
                  "wake", "wake_again"]:
        machine.send(event)


def test_order() -> None:
    machine = OrderFlow(model=Order())
    machine.send("submit")
    machine.send("pack")
    machine.send("charge", amount=-1)
    assert "broken" in [state.id for state in machine.configuration]


def test_big() -> None:
    machine = BigChart(model=Model())
    machine.send("go")
    for _ in range(11):
        machine.send("next0")
    for event in ("advance", "back", "advance", "finish"):
        machine.send(event)
