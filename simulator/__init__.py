"""A vLLM-like replica without a GPU: the performance model, the HTTP server, the DES mode.

See docs/simulator.md. Nothing here imports from the gateway or the policies (the gateway's
`demo` command, gateway/demo.py, composes the two); chat templates render with
`prefix_index.templates`, the one copy of vLLM's rendering (tests/engine holds it to real vLLM).
"""

from simulator.config import EngineConfig, OutputLengths, build_config
from simulator.des import (
    ClosedLoop,
    Cluster,
    ReplicaLoad,
    Router,
    SimRequest,
    chat_requests,
    run,
)
from simulator.engine import Engine
from simulator.faults import Fault
from simulator.fleet import Fleet
from simulator.perf_model import PerfModel
from simulator.profiles import GpuProfile, ModelProfile, get_gpu, get_model
from simulator.replica import Replica
from simulator.results import RequestRecord, RunResult
from simulator.tokenizer import ByteTokenizer, Tokenizer, TokenizerJson

__all__ = [
    "ByteTokenizer", "ClosedLoop", "Cluster", "Engine", "EngineConfig", "Fault", "Fleet", "GpuProfile",
    "ModelProfile", "OutputLengths", "PerfModel", "Replica", "ReplicaLoad", "RequestRecord",
    "Router", "RunResult", "SimRequest", "Tokenizer", "TokenizerJson", "build_config",
    "chat_requests", "get_gpu", "get_model", "run",
]
