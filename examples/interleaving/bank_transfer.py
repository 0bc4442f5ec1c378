"""Two threads moving money between accounts, each transfer a chart run: the worked example of
calexec's interleaving explorer on code that is not the executor (docs/framework.md, "The
explorer on your own threads").

The code takes a ``Clock`` (``calexec.machines.clock``) and makes its lock and threads through
it: the real clock in production, the explorer's virtual one under test. ``Bank(clock,
racy=True)`` has a seeded bug, a check-then-act race: the balance is checked under the lock,
the lock is released, and the debit takes it again, so two transfers can both pass the check.
The ``Transfer`` chart's contract (``@invariant`` on ``debited``: the source is never
overdrawn) reports the race at the debit that breaks it.
"""

from __future__ import annotations

import threading

from statemachine import State, StateMachine

from calexec.machines.chart_contracts import invariant
from calexec.machines.clock import SYSTEM, Clock
from calexec.machines.compiled import compiled


class Account:
    def __init__(self, name: str, balance: int) -> None:
        self.name, self.balance = name, balance

    def __repr__(self) -> str:
        return f"Account({self.name}, {self.balance})"


class TransferJob:
    """The model of one transfer: what the guards and the contract ask."""

    def __init__(self, source: Account, target: Account, amount: int) -> None:
        self.source, self.target, self.amount = source, target, amount
        self.funds_ok = False

    def funds_checked(self) -> bool:
        return self.funds_ok

    def __repr__(self) -> str:
        return f"TransferJob({self.source} -> {self.target}, {self.amount})"


class Transfer(StateMachine):
    """pending -debit-> debited -credit-> done, or pending -refuse-> refused."""

    pending = State(initial=True)
    debited = State()
    done = State(final=True)
    refused = State(final=True)

    debit = pending.to(debited, cond="funds_checked")
    refuse = pending.to(refused)
    credit = debited.to(done)

    @invariant("debited", "done")
    def source_never_overdrawn(job: TransferJob) -> bool:  # noqa: N805 (the model)
        return job.source.balance >= 0


class Bank:
    """Transfers between accounts under one lock made by ``clock``."""

    def __init__(self, clock: Clock = SYSTEM, racy: bool = False) -> None:
        self.clock, self.racy = clock, racy
        self.lock = clock.lock()

    def transfer(self, source: Account, target: Account, amount: int) -> str:
        job = TransferJob(source, target, amount)
        run = compiled(Transfer).run(job)
        with self.lock:
            job.funds_ok = source.balance >= amount
            if not self.racy and job.funds_ok:
                source.balance -= amount  # checked and debited under one hold
        if not job.funds_ok:
            return run.send("refuse")
        if self.racy:
            with self.lock:  # the bug: the check above may be stale by now
                source.balance -= amount
        run.send("debit")
        with self.lock:
            target.balance += amount
        return run.send("credit")


def two_transfers(clock: Clock, racy: bool, results: list[str]
                  ) -> tuple[Account, Account, list[threading.Thread]]:
    """Start two threads each moving 80 out of an account holding 100; ``results`` gets each
    transfer's final state. Returns the accounts and the threads (the caller joins them)."""
    alice, bob = Account("alice", 100), Account("bob", 0)
    bank = Bank(clock, racy=racy)
    threads = [clock.start_thread(lambda: results.append(bank.transfer(alice, bob, 80)), name)
               for name in ("teller-1", "teller-2")]
    return alice, bob, threads
