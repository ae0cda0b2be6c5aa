"""Names vulture (`make lint`'s dead-code check) cannot see used: called by grpc, starlette, uvicorn, tokenizers,
transformers and torch, or fields read by position."""

# ruff: noqa
from specrpc.edges.auth import TokenAuth
from specrpc.edges.grpc.service import GeneratorService
from specrpc.edges.grpc.wire import DecodeGuard

TokenAuth.intercept_service  # grpc.aio.ServerInterceptor
DecodeGuard.intercept_service  # grpc.aio.ServerInterceptor
GeneratorService.Converse  # the Generator servicer's RPC
GeneratorService.Rewrite  # the same
_.fim_default_layout  # a ModelInfo protobuf field
_.lifespan  # uvicorn.Config
_.should_exit  # uvicorn.Server
_.pre_tokenizer  # tokenizers.Tokenizer
_.decoder  # tokenizers.Tokenizer
_.generation_config  # transformers model
_.allow_tf32  # torch.backends
_._layers  # keeps the native step's tensors alive while C++ holds their pointers
_._keep  # the same
_.prefetch  # native.Model field, read by decode.cpp
_.prefetch_ahead  # native.Model field, read by decode.cpp
_.bonus  # VerifyResult field
_.pass_tokens  # a native.Model struct field, read by decode.cpp
_.scratch  # a native.DraftTransform struct field, read by decode.cpp
