"""Stop 66 (review): follow-ups of the stop's code review."""

from __future__ import annotations

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import Action, Decision, FaultController
from calexec.machines.job import Job


class _Target:
    """A FaultTarget whose lifecycle never ended (Ready), recording what it was asked."""

    def __init__(self) -> None:
        self.asked: list[Decision] = []

    def recovery_under_way(self) -> bool:
        return False

    def lifecycle_final(self) -> str | None:
        return None

    def request_recovery(self, decision: Decision) -> None:
        self.asked.append(decision)

    def disable_feature(self, status: Status, job: Job | None = None) -> object:
        return None


def _device_fault() -> Status:
    return Status.failure("device.hung", Category.DEVICE, Phase.WAIT, "the job hung")


def test_a_controller_attached_to_a_new_executor_decides_its_faults_again():
    """A STOP decided for the first executor (its COMPATIBILITY fault) ended that one; the
    controller attached to the next executor acts on its device fault (reset and rebuild),
    where it decided it ``none`` as "the lifecycle is already Failed", a lifecycle it never
    had."""
    controller = FaultController()
    first = _Target()
    controller.attach(first)
    controller.report(Status.failure("manifest.incompatible", Category.COMPATIBILITY,
                                     Phase.CONFIGURE, "the runtime cannot run this calbin"))
    assert [d.action for d in first.asked] == [Action.STOP]
    second = _Target()
    controller.attach(second)
    controller.report(_device_fault())
    assert [d.action for d in second.asked] == [Action.RESET_REBUILD], controller.decisions[-1]
