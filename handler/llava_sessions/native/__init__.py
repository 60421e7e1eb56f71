"""The native dialect: our ``type`` bodies (open/generate/add_image/reset/close), the AWS TorchServe
sample's aliases, TGI-style JSON lines. :mod:`.protocol` (requests and the commands they become),
:mod:`.responses` (replies and the one error encoder), :mod:`.serving` (request → engine → frames).
Imports nothing of ``llava_sessions.chat``; this file loads none of its modules."""
