"""Evaluation of the fidelity layer on real contracts (issue 4).

- ``sfcl.eval.questions``: rule-based question generator over ContractNLI NDAs (gold = spans);
- ``sfcl.eval.scorer``: answer accuracy and entity-consistency error (rules only);
- ``sfcl.eval.run``: ``sfcl eval`` (snapshot mode x steering, bootstrap CIs, table/JSON/PNG);
- ``sfcl.eval.calibrate``: ``sfcl anchors calibrate`` (trigger thresholds for a target rate);
- ``sfcl.eval.stress``: ``sfcl stress`` (the seed's anchor stress test).
"""
