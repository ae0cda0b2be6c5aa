"""Typed Python client for specrpc (specrpc.v1.Generator over gRPC).

    from specrpc_client import AsyncClient, Client

Names load on first use, so `import specrpc_client.cli` (the `specrpc complete|chat` arguments) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specrpc_client._core import NO_RETRY, UNSET, RetryPolicy
    from specrpc_client.aio import AsyncClient, AsyncGeneration, CompletionSession, Reply, VoiceSession
    from specrpc_client.errors import (
        Cancelled,
        DeadlineExceeded,
        FailedPrecondition,
        InvalidArgument,
        PermissionDenied,
        ResourceExhausted,
        SpecrpcError,
        Unauthenticated,
        Unavailable,
    )
    from specrpc_client.sync import Client, Conversation, Generation
    from specrpc_client.types import (
        Chunk,
        Constraint,
        ExtraFile,
        FimLayout,
        FinishReason,
        LineChange,
        ModelDescription,
        ModelInfo,
        Phrase,
        Proposer,
        Rewound,
        RewriteResult,
        Sampling,
        SessionStarted,
        Speculation,
        SpeculationPolicy,
        SpeculationStats,
        Summary,
        Timing,
        TokenAlternative,
        TokenLogprob,
        Tool,
        ToolCall,
        ToolChoice,
        ToolChoiceMode,
        TurnSummary,
    )

_WHERE = {
    "specrpc_client._core": ["NO_RETRY", "UNSET", "RetryPolicy"],
    "specrpc_client.aio": ["AsyncClient", "AsyncGeneration", "CompletionSession", "Reply", "VoiceSession"],
    "specrpc_client.errors": ["Cancelled", "DeadlineExceeded", "FailedPrecondition", "InvalidArgument",
                              "PermissionDenied", "ResourceExhausted", "SpecrpcError", "Unauthenticated",
                              "Unavailable"],
    "specrpc_client.sync": ["Client", "Conversation", "Generation"],
    "specrpc_client.types": ["Chunk", "Constraint", "ExtraFile", "FimLayout", "FinishReason", "LineChange",
                             "ModelDescription", "ModelInfo", "Phrase", "Proposer", "RewriteResult", "Rewound",
                             "Sampling", "SessionStarted", "Speculation", "SpeculationPolicy", "SpeculationStats",
                             "Summary", "Timing", "TokenAlternative", "TokenLogprob", "Tool", "ToolCall", "ToolChoice",
                             "ToolChoiceMode", "TurnSummary"],
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = [
    "NO_RETRY",
    "UNSET",
    "AsyncClient",
    "AsyncGeneration",
    "Cancelled",
    "Chunk",
    "Client",
    "CompletionSession",
    "Constraint",
    "Conversation",
    "DeadlineExceeded",
    "ExtraFile",
    "FailedPrecondition",
    "FimLayout",
    "FinishReason",
    "Generation",
    "InvalidArgument",
    "LineChange",
    "ModelDescription",
    "ModelInfo",
    "PermissionDenied",
    "Phrase",
    "Proposer",
    "Reply",
    "ResourceExhausted",
    "RetryPolicy",
    "Rewound",
    "RewriteResult",
    "Sampling",
    "SessionStarted",
    "SpecrpcError",
    "Speculation",
    "SpeculationPolicy",
    "SpeculationStats",
    "Summary",
    "Timing",
    "TokenAlternative",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolChoiceMode",
    "TurnSummary",
    "Unauthenticated",
    "Unavailable",
    "VoiceSession",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module 'specrpc_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE[name]), name)
    globals()[name] = value
    return value
