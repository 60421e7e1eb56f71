"""Developer and deployment tools around the worker core (``llava_sessions``), a sub-package each:
the server and its proxy (:mod:`.serve`: ``llava-serve``, the container's entrypoint), the local
SageMaker-runtime endpoint (:mod:`.local_endpoint`), deploy (:mod:`.deploy`), the demos (:mod:`.demo`)
and the random-weight checkpoint builder (:mod:`.tiny_model`); beside them the command-line and
process helpers they share (:mod:`.cli`, :mod:`.processes`). These import the core; the core never
imports them, and TorchServe's worker never loads them.
"""
