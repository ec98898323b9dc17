"""What the traced Neuron graphs cost, read from the HLO modules a dry run wrote (protobuf only, no Neuron SDK).

``hlo_schema``: the HLO protobuf schema; ``hlo_cost``: per-rank FLOPs, bytes read, copies and collectives of one
module; ``nki_cost``: the cost of NKI kernel custom calls; ``report``: the ``minimax-m3 graphs`` report, side by side
with :mod:`minimax_m3.planner`'s analytic minimum.
"""
