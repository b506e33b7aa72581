"""Which failures of a task Flyte retries.

Flyte retries a task only after a recoverable failure. System failures (the pod lost with its node, evicted,
preempted on an interruptible node, the platform unreachable) are recoverable and retried under the platform's
own budget. An exception in a task's code is a user error, and flytekit reports it as non-recoverable, failing
the node at once, unless it is a `FlyteRecoverableException`: those are retried up to the node's `retries`
(the recipe's cluster.retries). That is what we want for a bad recipe, a bad batch or a bug, which fail the same
way on every attempt; but a dropped connection to the object store, an SGLang server or a remote reward model
may well pass on the next attempt. `recoverable` raises those as `FlyteRecoverableException`, everything else
unchanged. (In an Elastic task it runs in each worker, where kfpytorch reads the exception's kind.)
"""

from __future__ import annotations

import functools

import botocore.exceptions
import requests
from flytekit.exceptions.user import FlyteRecoverableException

# the network and object-store errors of the clients the tasks use (builtin sockets, requests, boto/s3fs)
TRANSIENT = (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout, botocore.exceptions.HTTPClientError)


def transient(err: BaseException) -> bool:
    """`err`, or an exception it was raised from or while handling, is a network or object-store error."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, TRANSIENT):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def recoverable(fn):
    """`fn`, raising a transient error (see `transient`) as FlyteRecoverableException, so that Flyte retries it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if transient(err):
                raise FlyteRecoverableException(f"{type(err).__name__}: {err} (transient: retried)") from err
            raise

    return run
