"""The request and response classes the AWS TorchServe LLaVA sample's notebook imports (``data_types``).

aws-samples/sagemaker-genai-hosting-examples, ``LLava/torchserve/workspace/llava_stateful_deploy_infer.ipynb``
imports ``BaseRequest``, ``StartSessionRequest``, ``TextPromptRequest``, ``CloseSessionRequest`` and
their responses from a ``data_types`` module built on ``dataclasses_json`` (the notebook installs it).
That module is not in the sample's public tree, so these classes carry exactly the fields the
notebook and the sample's handler use (``type``, ``path``, ``session_id``, ``prompt_text``;
``session_id``, ``response_text``, ``success``), with ``dataclasses_json``'s own ``to_json`` /
``from_json``. Unknown reply fields are ignored, as ``dataclasses_json`` does by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from dataclasses_json import dataclass_json


@dataclass_json
@dataclass
class BaseRequest:
    type: str
    session_id: str | None = None


@dataclass_json
@dataclass
class StartSessionRequest(BaseRequest):
    path: str = ""


@dataclass_json
@dataclass
class TextPromptRequest(BaseRequest):
    prompt_text: str = ""


@dataclass_json
@dataclass
class CloseSessionRequest(BaseRequest):
    pass


@dataclass_json
@dataclass
class OpenSessionResponse:
    session_id: str


@dataclass_json
@dataclass
class TextPromptResponse:
    response_text: str


@dataclass_json
@dataclass
class CloseSessionResponse:
    success: bool
