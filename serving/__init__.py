"""WHERE the policy is enforced: Ray Serve deployments, the OpenAI-compatible ingress, the request router.

    from evocache.serving import ServingConfig, build_app      # a Ray Serve application
    evocache serve                                              # the embedded app on a local Ray

The replica's work (``ModelServer``), the HTTP API (``Api``, ``build_fastapi``), the wire format and the
tenants need no Ray; ``build_app`` and the deployments import it when called. See docs/serving.md.
"""

from ._affinity import BlockLedger
from ._lazy import lazy_getattr as _lazy_getattr
from ._model import ByteTokenizer, CallableGenerator, GenerationParams, HFGenerator, ModelConfig, load_tokenizer
from ._request import Completion, Decision, Finish, GenerateRequest
from ._auth import (
    AdminKeys,
    FileKeyStore,
    KeyStore,
    Rate,
    RateLimiter,
    RedisKeyStore,
    authenticate,
    bearer_key,
    key_digest,
)
from ._protocol import (
    IGNORED_CHAT_FIELDS,
    IGNORED_COMPLETION_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ContentPart,
    Delta,
    ErrorDetail,
    ErrorResponse,
    Limits,
    Message,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    StreamOptions,
    ToolCall,
    ToolCallFunction,
    Usage,
    error_response,
    parse_request,
    validation_error,
)
from .errors import (
    ApiError,
    BadRequest,
    Forbidden,
    RateLimited,
    ServingConfigError,
    ServingError,
    Unauthenticated,
    Unavailable,
)

# Imported on first use: the HTTP app (FastAPI), the replica (the controller's runtime) and the application
# builder, so `evocache policy check` and other light commands do not pay for them.
_LAZY = {
    "Api": "._ingress", "Backend": "._ingress", "build_fastapi": "._ingress", "serve_metrics": "._ingress",
    "LocalBackend": "._local",
    "merge_expositions": "._metrics",
    "ModelServer": "._server", "ServerSpec": "._server",
    "ApiKeysConfig": "._app", "DeploymentConfig": "._app", "MetricsConfig": "._app", "RateConfig": "._app",
    "ServingConfig": "._app",
    "build_app": "._app", "start_local": "._app",
}  # fmt: skip

__getattr__ = _lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "Api",
    "ApiError",
    "ApiKeysConfig",
    "Backend",
    "BlockLedger",
    "ByteTokenizer",
    "CallableGenerator",
    "Completion",
    "Decision",
    "DeploymentConfig",
    "Finish",
    "GenerateRequest",
    "GenerationParams",
    "HFGenerator",
    "LocalBackend",
    "MetricsConfig",
    "ModelConfig",
    "ModelServer",
    "RateConfig",
    "ServerSpec",
    "ServingConfig",
    "build_app",
    "build_fastapi",
    "load_tokenizer",
    "merge_expositions",
    "serve_metrics",
    "start_local",
    "AdminKeys",
    "AssistantMessage",
    "BadRequest",
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChunkChoice",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "Delta",
    "ErrorDetail",
    "ErrorResponse",
    "FileKeyStore",
    "Forbidden",
    "IGNORED_CHAT_FIELDS",
    "IGNORED_COMPLETION_FIELDS",
    "KeyStore",
    "Limits",
    "Message",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "Rate",
    "RateLimited",
    "RateLimiter",
    "RedisKeyStore",
    "ServingConfigError",
    "ServingError",
    "StreamOptions",
    "ToolCall",
    "ToolCallFunction",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "authenticate",
    "bearer_key",
    "error_response",
    "key_digest",
    "parse_request",
    "validation_error",
]
