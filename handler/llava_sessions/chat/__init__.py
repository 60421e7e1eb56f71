"""The chat dialect: OpenAI chat completions and AWS's ``requestType`` session bodies.
:mod:`.protocol` (requests and the command they become), :mod:`.responses` (``chat.completion``, chunks,
OpenAI's error object), :mod:`.serving` (request → engine → frames). Imports nothing of
``llava_sessions.native``; this file loads none of its modules."""
