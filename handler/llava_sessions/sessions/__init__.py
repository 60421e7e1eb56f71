"""The sessions' state: the conversation's key rules (:mod:`.conversation`, no torch), the memory
ledger in plain integers (:mod:`.ledger`, no torch), one session's tensors (:mod:`.session`) and the
store of them under the ledger (:mod:`.store`). Import the module you need: this file loads none."""
