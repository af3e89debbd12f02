"""``pyro-fa revrand``: the three tables of the revrand technical report with random-feature linear models.

=====================  ===========================================================================
:mod:`.command`        the subcommand: its options, budget and the run of the three tables
:mod:`.tables`         data, folds, and every method run on the same folds
:mod:`.models`         our SLM and GLM: how their hyperparameters are started and chosen
:mod:`.baselines`      the scikit-learn peers, as the report ran them
:mod:`.report`         metrics, the report's numbers, tables and bar checks
=====================  ===========================================================================
"""
