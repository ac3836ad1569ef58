"""The vitlens app's package: ``app.py`` (``streamlit run app.py``) is a thin shell over it.

- ``views``: the pages, one module per view, and ``pages()`` (the view selector's choices);
- ``sidebar``: the model picker, the image set, the model's facts;
- ``header``: the access check, the model loaded and the current image with its predictions;
- ``caches``: the cached models and results (``st.cache_resource`` / ``st.cache_data``), the heavy lock and the
  results remembered per session;
- ``context``: what every page is given (``Context``) and what every page draws the same way;
- ``kind_choices``: every choice the app makes by a model's kind;
- ``library``: the one module that imports the library's non-public parts; every other module imports the
  public ``vitlens`` API and ``vitlens.figures`` only (``tests/test_app_layout.py``);
- ``fair_lock``, ``uploads``: the app's first-come-first-served heavy lock and its uploads' folders and limits.

Not ``pages/``: Streamlit would turn a ``pages/`` folder beside ``app.py`` into its own navigation.
"""
