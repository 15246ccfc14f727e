"""Parameter-server mode: sharded parameters on PS pods, workers that push and pull.

See :mod:`.api` for the user API, :mod:`.partition` for how parameters are spread
over the servers, :mod:`.serving.server` for the PS process and :mod:`.wire.client`
for a worker's side of the transport.
"""

from .api import run
from .evaluator import Evaluator
from .serving.consistency import Consistency, Mode
from .serving.optim import OptimizerKind, ServerOptimizer
from .worker import PSJob, StepInfo, WorkerReport

__all__ = ["Consistency", "Evaluator", "Mode", "OptimizerKind", "PSJob", "ServerOptimizer",
           "StepInfo", "WorkerReport", "run"]
