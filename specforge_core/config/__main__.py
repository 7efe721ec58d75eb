"""Print a run config resolved (defaults filled in, overrides applied, credentials masked), or the schema.

    python -m specforge_core.config --config examples/tiny-cpu.yaml            # print resolved
    python -m specforge_core.config --config C.yaml training.learning_rate=5e-5
    python -m specforge_core.config --schema                                   # JSON schema
"""

import json
import sys

import yaml

from specforge_core.cli import command_parser, run_command
from specforge_core.config import dump_config, json_schema, load_config
from specforge_core.drafts import check_config


def main(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "python -m specforge_core.config", config_required=False,
                        overrides_example="training.learning_rate=5e-5")
    ap.add_argument("--schema", action="store_true", help="print the JSON schema and exit")
    args = ap.parse_args(argv)
    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return 0

    def show() -> None:
        print(yaml.safe_dump(dump_config(check_config(load_config(args.config, args.overrides))), sort_keys=False))

    return run_command(show)


if __name__ == "__main__":
    sys.exit(main())
