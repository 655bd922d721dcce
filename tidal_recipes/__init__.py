"""Recipes built on the tidal library, kept apart from it: the GRPO reference trainer and its
toy task (:mod:`tidal_recipes.grpo`), and the ``tidal`` command line (:mod:`tidal_recipes.cli`:
``demo``, ``bench``, ``plan``). The library (:mod:`tidal`) never imports them.
"""
