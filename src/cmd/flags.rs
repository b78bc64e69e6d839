//! The fork flags on the command line, generated from the fork table
//! ([`crate::engine::forks::FORKS`]): [`ForkArgs`] adds `--l1/--l2/--l3` and one flag per fork
//! to any subcommand through `#[command(flatten)]`, and `mlxb flags` prints what a
//! combination resolves to (or the README table with `--markdown`).

use crate::engine::forks::{self, Domain, Forks, Resolution, Tier, FORKS};
use clap::builder::PossibleValuesParser;
use clap::{Arg, ArgAction, ArgGroup, ArgMatches, Args, Command, FromArgMatches};

/// The tier alias and the explicitly given fork flags, as parsed.
#[derive(Debug, Clone, Default)]
pub struct ForkArgs {
    /// `--l1`, `--l2` or `--l3` (none = `--l1`).
    pub tier: Option<Tier>,
    /// `(fork name, value)` for every fork flag given, in table order.
    pub explicit: Vec<(String, String)>,
}

const HEADING: &str = "Forks and parity tiers (see `mlxb flags`)";

fn fork_arg(f: &'static forks::Fork) -> Arg {
    let defaults = Tier::ALL
        .iter()
        .map(|t| format!("{t}: {}", f.default_in(*t)))
        .collect::<Vec<_>>()
        .join(", ");
    let arg = Arg::new(f.name)
        .long(f.name)
        .value_name(match &f.domain {
            Domain::Choices(c) if c.iter().all(|c| ["on", "off"].contains(&c.value)) => "on|off",
            Domain::Choices(_) => "VALUE",
            Domain::Count => "N",
        })
        .action(ArgAction::Set)
        .help_heading(HEADING)
        .help(format!("{} [{defaults}]", f.help));
    match &f.domain {
        Domain::Choices(c) => {
            arg.value_parser(PossibleValuesParser::new(c.iter().map(|c| c.value)))
        }
        Domain::Count => arg.value_parser(move |s: &str| {
            f.check(s).map(|_| s.to_owned()).map_err(|e| e.to_string())
        }),
    }
}

fn augment(cmd: Command) -> Command {
    let mut cmd = cmd;
    for t in Tier::ALL {
        cmd = cmd.arg(
            Arg::new(t.flag())
                .long(t.flag())
                .action(ArgAction::SetTrue)
                .help_heading(HEADING)
                .help(format!(
                    "Tier {t}: set every fork to its {t} default (explicit fork flags override); parity with {}",
                    t.oracle()
                )),
        );
    }
    cmd = cmd.group(
        ArgGroup::new("tier")
            .args(Tier::ALL.map(Tier::flag))
            .multiple(false),
    );
    for f in FORKS {
        cmd = cmd.arg(fork_arg(f));
    }
    cmd
}

impl FromArgMatches for ForkArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut s = Self::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        for t in Tier::ALL {
            if m.get_flag(t.flag()) {
                self.tier = Some(t);
            }
        }
        for f in FORKS {
            if let Some(v) = m.get_one::<String>(f.name) {
                self.explicit.retain(|(n, _)| n != f.name);
                self.explicit.push((f.name.to_owned(), v.clone()));
            }
        }
        Ok(())
    }
}

impl Args for ForkArgs {
    fn augment_args(cmd: Command) -> Command {
        augment(cmd)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        augment(cmd)
    }
}

impl ForkArgs {
    /// Resolves the tier and the explicit flags against the table.
    pub fn resolve(&self) -> crate::engine::error::Result<Resolution> {
        forks::resolve(self.tier, &self.explicit)
    }

    /// Resolves and prints the documented warnings to stderr (what the commands run with).
    pub fn forks(&self) -> anyhow::Result<Forks> {
        let r = self.resolve()?;
        for w in &r.warnings {
            eprintln!("mlxb: warning: {w}");
        }
        Ok(r.forks)
    }
}

/// Flags of `mlxb flags`.
#[derive(Debug, Args)]
pub struct FlagsArgs {
    #[command(flatten)]
    pub forks: ForkArgs,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    pub json: bool,
    /// Print the README flag table (Markdown), generated from the fork table.
    #[arg(long, conflicts_with = "json")]
    pub markdown: bool,
}

/// Entry point of `mlxb flags`.
pub fn run(args: FlagsArgs) -> anyhow::Result<()> {
    if args.markdown {
        print!("{}", forks::markdown_table());
        return Ok(());
    }
    let r = args.forks.resolve()?;
    if args.json {
        println!("{}", r.json());
    } else {
        print!("{}", r.text());
    }
    Ok(())
}

/// Resolves the fork flags and opens the model with them, printing every documented warning
/// (flags without effect, forks with nothing to act on in this model) to stderr.
pub fn open_session(
    dir: &std::path::Path,
    forks: &ForkArgs,
) -> anyhow::Result<(crate::engine::session::Session, Forks)> {
    let forks = forks.forks()?;
    let session =
        crate::engine::session::Session::open_traced(dir, forks, super::progress::startup_trace())?;
    for w in &session.model.plan.warnings {
        eprintln!("mlxb: warning: {w}");
    }
    Ok((session, forks))
}
