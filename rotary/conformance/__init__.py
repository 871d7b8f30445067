"""The cross-backend conformance cases (:mod:`.cases`, run by the tests and ``python -m rotary
conformance``) and the bad-input catalogue (:mod:`.error_cases`, ``python -m rotary conformance
--errors``)."""
