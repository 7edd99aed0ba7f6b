//! Civil timestamps for Azure traces: `YYYY-MM-DD HH:MM:SS[.fraction]` without a time zone, to and
//! from nanoseconds since 1970-01-01 00:00:00 of the same (unnamed) zone, with proleptic-Gregorian
//! date arithmetic (H. Hinnant's `days_from_civil` and its inverse).

const NANOS_PER_SECOND: i128 = 1_000_000_000;

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` may separate date and time; the fraction may have
/// any number of digits, kept to nanoseconds) into nanoseconds since 1970-01-01 00:00:00 of the
/// same (unnamed) time zone. Returns `None` for anything else, including impossible dates.
pub(super) fn parse_civil_timestamp_nanos(text: &str) -> Option<i128> {
    let (date, time) = text.split_once([' ', 'T'])?;
    let mut date_parts = date.split('-');
    let year = i64::from(parse_digits(date_parts.next()?, 1, 4)?);
    let month = parse_digits(date_parts.next()?, 1, 2)?;
    let day = parse_digits(date_parts.next()?, 1, 2)?;
    if date_parts.next().is_some() || !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }

    let (clock, fraction) = match time.trim().split_once('.') {
        Some((clock, fraction)) => (clock, Some(fraction)),
        None => (time.trim(), None),
    };
    let mut clock_parts = clock.split(':');
    let hour = parse_digits(clock_parts.next()?, 1, 2)?;
    let minute = parse_digits(clock_parts.next()?, 1, 2)?;
    let second = parse_digits(clock_parts.next()?, 1, 2)?;
    if clock_parts.next().is_some() || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let fraction_nanos = match fraction {
        None => 0,
        Some(digits) => {
            if digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
                return None;
            }
            // Keep nanoseconds: the first nine digits, right-padded with zeros.
            let kept = &digits[..digits.len().min(9)];
            let value: i128 = kept.parse().ok()?;
            value * 10i128.pow(9 - kept.len() as u32)
        }
    };
    let days = days_from_civil(year, month, day) as i128;
    let seconds = days * 86_400 + (hour * 3600 + minute * 60 + second) as i128;
    Some(seconds * NANOS_PER_SECOND + fraction_nanos)
}

/// The inverse of [`parse_civil_timestamp_nanos`], for error messages.
pub(super) fn format_civil_timestamp_nanos(nanos: i128) -> String {
    let seconds = nanos.div_euclid(NANOS_PER_SECOND);
    let fraction = nanos.rem_euclid(NANOS_PER_SECOND);
    let days = seconds.div_euclid(86_400) as i64;
    let second_of_day = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{fraction:09}",
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// Parses `min_digits..=max_digits` ASCII digits.
fn parse_digits(text: &str, min_digits: usize, max_digits: usize) -> Option<u32> {
    if text.len() < min_digits || text.len() > max_digits || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn is_leap_year(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap_year(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days from 1970-01-01 to the given proleptic-Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400; // [0, 399]
    let month_from_march = (i64::from(month) + 9) % 12; // March = 0
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1; // [0, 365]
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year; // [0, 146096]
    era * 146_097 + day_of_era - 719_468
}

/// The inverse of [`days_from_civil`]: `(year, month, day)`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_timestamps_parse_to_unix_time_and_reject_impossible_dates() {
        assert_eq!(parse_civil_timestamp_nanos("1970-01-01 00:00:00"), Some(0));
        assert_eq!(
            parse_civil_timestamp_nanos("2023-11-16 18:17:03.9799600"),
            Some(1_700_158_623 * NANOS_PER_SECOND + 979_960_000)
        );
        assert_eq!(parse_civil_timestamp_nanos("1969-12-31 23:59:59.9"), Some(-100_000_000));
        assert_eq!(parse_civil_timestamp_nanos("2000-02-29 00:00:00").map(|n| n / NANOS_PER_SECOND), Some(951_782_400));
        for bad in [
            "1900-02-29 00:00:00",
            "2023-13-01 00:00:00",
            "2023-04-31 00:00:00",
            "2023-11-16 24:00:00",
            "2023-11-16 18:60:00",
            "2023-11-16 18:17:03.",
            "2023-11-16 18:17:03.12a",
            "2023-11-16",
            "2023-11-16 18:17",
            "16/11/2023 18:17:03",
            "",
        ] {
            assert_eq!(parse_civil_timestamp_nanos(bad), None, "{bad:?}");
        }
        for days in [-800_000, -1, 0, 19_677, 2_932_896] {
            let (year, month, day) = civil_from_days(days);
            assert_eq!(days_from_civil(year, month, day), days);
        }
        let nanos = parse_civil_timestamp_nanos("2023-11-16 18:17:03.9799600").unwrap();
        assert_eq!(format_civil_timestamp_nanos(nanos), "2023-11-16 18:17:03.979960000");
    }
}
