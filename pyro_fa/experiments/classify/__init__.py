"""``pyro-fa classify``: calibration and out-of-distribution detection on MNIST-1D and digits.

=====================  ===========================================================================
:mod:`.command`        the subcommand: its options, the run over datasets × networks × seeds
:mod:`.data`           train / validation / test splits and out-of-distribution sets
:mod:`.methods`        the networks and pyro_fa's methods (and Pyro's guides, MAP, ensembles)
:mod:`.baselines`      the peers run from their own packages: laplace-torch and IVON
:mod:`.report`         metrics, tables, bar checks and figures
=====================  ===========================================================================
"""
