//! A small command-line parser for the tools: perftest-style short and long flags, typed values,
//! and errors that name the flag and what was wrong with it.
//!
//! Tools declare their flags as data ([`Spec`]), so `--help` and error messages come from one
//! place and an unknown or malformed flag is always a clear error, never a panic.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// One flag a tool accepts.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Short form without the dash (`'s'` for `-s`), if any.
    pub short: Option<char>,
    /// Long form without the dashes (`"size"` for `--size`).
    pub long: &'static str,
    /// Whether it takes a value.
    pub value: Option<&'static str>,
    /// One line of help.
    pub help: &'static str,
}

impl Spec {
    /// A flag taking a value named `value` in the help.
    pub const fn opt(
        short: Option<char>,
        long: &'static str,
        value: &'static str,
        help: &'static str,
    ) -> Spec {
        Spec {
            short,
            long,
            value: Some(value),
            help,
        }
    }

    /// A switch (no value).
    pub const fn switch(short: Option<char>, long: &'static str, help: &'static str) -> Spec {
        Spec {
            short,
            long,
            value: None,
            help,
        }
    }
}

/// Why a command line was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    /// `--help` was asked for; the text is the help.
    Help(String),
    /// A flag nobody declared.
    Unknown(String),
    /// A flag that needs a value got none.
    MissingValue(String),
    /// A value that does not parse.
    BadValue {
        /// The flag.
        flag: String,
        /// The value given.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// Too many positional arguments.
    ExtraArgument(String),
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Help(text) => f.write_str(text),
            CliError::Unknown(flag) => write!(f, "unknown option `{flag}` (try --help)"),
            CliError::MissingValue(flag) => write!(f, "option `{flag}` needs a value"),
            CliError::BadValue {
                flag,
                value,
                expected,
            } => write!(f, "option `{flag}`: `{value}` is not {expected}"),
            CliError::ExtraArgument(a) => write!(f, "unexpected argument `{a}`"),
        }
    }
}

impl std::error::Error for CliError {}

/// A parsed command line.
#[derive(Debug, Clone, Default)]
pub struct Args {
    values: HashMap<&'static str, Vec<String>>,
    positional: Vec<String>,
}

impl Args {
    /// Parses `argv` (without the program name) against `specs`, allowing at most
    /// `max_positional` positional arguments.
    ///
    /// # Errors
    /// A [`CliError`] naming the offending argument; `--help`/`-h` gives [`CliError::Help`].
    pub fn parse<I, S>(
        tool: &str,
        about: &str,
        specs: &[Spec],
        max_positional: usize,
        argv: I,
    ) -> Result<Args, CliError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut args = Args::default();
        let mut it = argv.into_iter().map(Into::into).peekable();
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                return Err(CliError::Help(help(tool, about, specs)));
            }
            if arg == "--" {
                args.positional.extend(it.by_ref());
                break;
            }
            let (spec, inline) = if let Some(long) = arg.strip_prefix("--") {
                let (name, val) = match long.split_once('=') {
                    Some((n, v)) => (n, Some(v.to_string())),
                    None => (long, None),
                };
                let name = name.replace('-', "_");
                let spec = specs
                    .iter()
                    .find(|s| s.long.replace('-', "_") == name)
                    .ok_or_else(|| CliError::Unknown(arg.clone()))?;
                (spec, val)
            } else if let Some(short) = arg
                .strip_prefix('-')
                .filter(|s| !s.is_empty() && !s.starts_with(|c: char| c.is_ascii_digit()))
            {
                let mut chars = short.chars();
                let c = chars.next().unwrap_or('-');
                let rest: String = chars.collect();
                let spec = specs
                    .iter()
                    .find(|s| s.short == Some(c))
                    .ok_or_else(|| CliError::Unknown(arg.clone()))?;
                (spec, (!rest.is_empty()).then_some(rest))
            } else {
                if args.positional.len() >= max_positional {
                    return Err(CliError::ExtraArgument(arg));
                }
                args.positional.push(arg);
                continue;
            };
            let value = match (spec.value, inline) {
                (None, None) => String::new(),
                (None, Some(_)) => {
                    return Err(CliError::BadValue {
                        flag: arg.clone(),
                        value: arg.clone(),
                        expected: "a switch without a value".into(),
                    });
                }
                (Some(_), Some(v)) => v,
                (Some(_), None) => it
                    .next()
                    .ok_or_else(|| CliError::MissingValue(arg.clone()))?,
            };
            args.values.entry(spec.long).or_default().push(value);
        }
        Ok(args)
    }

    /// Whether a switch or option was given.
    pub fn has(&self, long: &str) -> bool {
        self.values.contains_key(long)
    }

    /// The last value of an option, as text.
    pub fn str(&self, long: &str) -> Option<&str> {
        self.values
            .get(long)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    /// The last value of an option, parsed; `default` when absent.
    ///
    /// # Errors
    /// [`CliError::BadValue`] when it does not parse as `T`.
    pub fn get<T: FromStr>(&self, long: &str, default: T) -> Result<T, CliError> {
        match self.str(long) {
            None => Ok(default),
            Some(v) => parse_value(long, v),
        }
    }

    /// The last value of an option, parsed, if given.
    ///
    /// # Errors
    /// [`CliError::BadValue`] when it does not parse as `T`.
    pub fn opt<T: FromStr>(&self, long: &str) -> Result<Option<T>, CliError> {
        self.str(long).map(|v| parse_value(long, v)).transpose()
    }

    /// Positional arguments.
    pub fn positional(&self) -> &[String] {
        &self.positional
    }
}

fn parse_value<T: FromStr>(long: &str, v: &str) -> Result<T, CliError> {
    parse_size(v)
        .and_then(|n| n.to_string().parse::<T>().ok())
        .or_else(|| v.parse::<T>().ok())
        .ok_or_else(|| CliError::BadValue {
            flag: format!("--{long}"),
            value: v.to_string(),
            expected: format!(
                "a valid {}",
                std::any::type_name::<T>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("value")
            ),
        })
}

/// Parses sizes like `64`, `4K`, `16M`, `1G` (powers of 1024).
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.char_indices().last()? {
        (i, 'k' | 'K') => (&v[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&v[..i], 1 << 20),
        (i, 'g' | 'G') => (&v[..i], 1 << 30),
        _ => (v, 1),
    };
    if mult == 1 {
        return None;
    }
    num.parse::<u64>().ok()?.checked_mul(mult)
}

fn help(tool: &str, about: &str, specs: &[Spec]) -> String {
    let mut out = format!("{tool}: {about}\n\nOptions:\n");
    for s in specs {
        let short = s
            .short
            .map(|c| format!("-{c}, "))
            .unwrap_or_else(|| "    ".into());
        let long = match s.value {
            Some(v) => format!("--{} <{v}>", s.long),
            None => format!("--{}", s.long),
        };
        out.push_str(&format!("  {short}{long:<30} {}\n", s.help));
    }
    out.push_str("  -h, --help                         this text\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[Spec] = &[
        Spec::opt(Some('s'), "size", "bytes", "message size"),
        Spec::opt(Some('n'), "iters", "count", "iterations"),
        Spec::switch(Some('a'), "all", "all sizes"),
        Spec::switch(None, "report_gbits", "Gbit/s"),
    ];

    fn parse(v: &[&str]) -> Result<Args, CliError> {
        Args::parse("t", "test", SPECS, 1, v.iter().copied())
    }

    #[test]
    fn short_long_and_positional() {
        let a = parse(&["-s", "4K", "--iters=10", "-a", "10.0.0.1", "--report-gbits"]).unwrap();
        assert_eq!(a.get::<u64>("size", 0).unwrap(), 4096);
        assert_eq!(a.get::<u32>("iters", 0).unwrap(), 10);
        assert!(a.has("all") && a.has("report_gbits"));
        assert_eq!(a.positional(), ["10.0.0.1"]);
        let b = parse(&["-s64", "-n5"]).unwrap();
        assert_eq!(b.get::<u64>("size", 0).unwrap(), 64);
        assert_eq!(b.get::<u64>("iters", 0).unwrap(), 5);
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        assert_eq!(parse(&["-z"]).unwrap_err(), CliError::Unknown("-z".into()));
        assert_eq!(
            parse(&["--bogus"]).unwrap_err(),
            CliError::Unknown("--bogus".into())
        );
        assert_eq!(
            parse(&["-s"]).unwrap_err(),
            CliError::MissingValue("-s".into())
        );
        assert!(matches!(parse(&["a", "b"]).unwrap_err(), CliError::ExtraArgument(x) if x == "b"));
        let a = parse(&["-s", "lots"]).unwrap();
        let e = a.get::<u64>("size", 0).unwrap_err();
        assert!(e.to_string().contains("--size") && e.to_string().contains("lots"));
        assert!(matches!(
            parse(&["--all=3"]),
            Err(CliError::BadValue { .. })
        ));
        assert!(
            matches!(parse(&["--help"]), Err(CliError::Help(h)) if h.contains("--size <bytes>"))
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("12"), None);
        assert_eq!(parse_size("xK"), None);
    }
}
