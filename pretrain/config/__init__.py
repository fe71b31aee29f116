"""The settings: one pydantic tree (`tree`), its presets, and the DeepSpeed JSON it renders
(`ds_render`) and reads back (`ds_read`, with the key catalogue in `ds_keys`).

Nothing here imports torch or DeepSpeed: a config is checked in a fraction of a second, before
any rank starts.
"""
