"""What both dialects stand on: the SageMaker session contract (:mod:`.contract`), the inbound body
and its models' rules (:mod:`.inbound`), TorchServe's framing (:mod:`.framing`) and the requests in
flight (:mod:`.requests`). Import the module you need: this file loads none (no torch for the first three)."""
