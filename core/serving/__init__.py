"""Serving the cluster over HTTP: an OpenAI-compatible endpoint (``edgeshard serve``).

A thin adapter over the run machinery ``edgeshard run`` uses (one coordinator, one run state,
one recording), not a second runtime; docs/serving.md says what is served and how.

Public: ``openai_api`` (bodies decoded and checked, answers and stream chunks built, the error
object), ``served`` (one request while it is served), ``scheduler`` (the bounded queue and
which requests share a run), ``cluster_runs`` (``ServedModel``: requests become recorded runs
of the loaded plan), ``app`` (the Starlette app), ``http_server`` (uvicorn on a bound socket),
``endpoint`` (all of them put together: what ``edgeshard serve`` and the studio's Serve toggle start).
"""

from core.serving.app import build_app
from core.serving.cluster_runs import ServedModel, ServeSettings
from core.serving.endpoint import EndpointLimits, ServingEndpoint
from core.serving.http_server import HttpServer, bind, is_loopback
from core.serving.model_config import model_context
from core.serving.openai_api import ApiError, Defaults, plain_chat_prompt
from core.serving.scheduler import BatchQueue, choose_batch

__all__ = ["ApiError", "BatchQueue", "Defaults", "EndpointLimits", "HttpServer", "ServingEndpoint", "ServeSettings", "ServedModel", "bind", "build_app",
           "choose_batch", "is_loopback", "model_context", "plain_chat_prompt"]
