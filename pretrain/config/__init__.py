"""The settings: one pydantic tree (`tree`, its sections in `section`, `batch`, `engine_sections` and
`run_sections`), the layered build (`presets`, `loading`), the parallel layout it resolves to
(`layout`), the field reference (`reference`), and the DeepSpeed JSON it renders (`ds_render`,
`ds_configs`) and reads back (`ds_read`, `ds_values`, `ds_optimizer`, `ds_validators`, `ds_keys`).

Nothing here imports torch, nor DeepSpeed but to ask its validators: a config is checked in a
fraction of a second, before any rank starts.
"""
