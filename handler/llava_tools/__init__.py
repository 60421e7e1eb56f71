"""Developer and deployment tools around the worker core (``llava_sessions``).

Local TorchServe with a supervisor (:mod:`.serve`), the container entrypoint (:mod:`.container`),
a local SageMaker-runtime endpoint (:mod:`.local_endpoint`), deploy (:mod:`.deploy`), the
random-weight checkpoint builder (:mod:`.tiny_model`) and the demo (:mod:`.demo`). These import the
core; the core never imports them, and TorchServe's worker never loads them.
"""
