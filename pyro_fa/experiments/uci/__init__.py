"""``pyro-fa uci``: the UCI Bayesian-neural-network regression benchmark on the standard splits.

=====================  ===========================================================================
:mod:`.command`        the subcommand: its options, the run over datasets × methods, the report
:mod:`.protocol`       methods, budget, search and final-fit data, the VI methods' runs
:mod:`.swag_family`    the SWAG family: one MAP search, SGD collection phases, one column each
:mod:`.factor_ivon`    FactorIVON's column: BatchedFactorIVON, a phase's fits as one batch, IVON's grid
:mod:`.mc_dropout`     MC dropout's column (Gal & Ghahramani 2016): dropout rate x model precision, batched
:mod:`.results`        the result folder: one keyed unit file per dataset × method
:mod:`.report`         tables, figures and the published anchors (Jiang 2023, Table 3)
=====================  ===========================================================================
"""
